"""The agent's two schedules side by side: `agent.schedule=trajectory` (each trajectory on its own,
its turns joining the engine's running batch) against `turn` (lock step), on the search-agent
recipe's shape, with a retrieval service whose latency is drawn per call, alternated in one run.

    .venv/bin/python benchmarks/agent_schedule.py                     # built-in engine and vLLM's CPU build
    .venv/bin/python benchmarks/agent_schedule.py --engines hf --rounds 5
    .venv/bin/python benchmarks/agent_schedule.py --quick             # smoke test
    .venv/bin/python benchmarks/agent_schedule.py --model flat        # a step's cost flat in its rows
    .venv/bin/python benchmarks/agent_schedule.py --shape long        # turns of up to 256 tokens

Each engine runs in a child process of its own (hf in `--hf-python`, vllm in `--vllm-python`,
the environments `make setup setup-vllm` builds) in float32, on SmolLM2-135M (built in) or, with
`--model flat`, SmolLM2's layout at width 64 with random weights: there a decode step costs about
the same at 1 row and at 16 (the run prints both), as a 7B's does on a GPU, where on this CPU
SmolLM2's step grows about 1.6x from 1 row to 16 and a prefill token costs ~2 ms, costs that
no schedule hides. A rollout is the recipe's step: 4 prompts x 4 samples, at most 4 turns, the
policy answering itself (configs/search_agent.yaml). The untrained policy writes no actions, so
every turn is scripted (its tokens forced, one a decode step, as tests/vision_helpers.ForcedTurns
does): a row searches 1-3 times, then answers; each turn is seeded filler, log-normal (sigma
1.2), then its action: `--shape short` median 6 tokens, at most 44, turns of at most 64 tokens;
`--shape long` median 24, at most 240, turns of at most 256. Searches go over HTTP (grouprl's
RetrievalClient and SearchTool, up to agent.retriever.max_in_flight requests at once) to a
service in the child that answers each query with `--sentences` sentences after a latency drawn
per (row, turn), seeded: `tail` log-uniform on 0.05-2 s, `lognormal` median 0.2 s clipped to
0.05-2 s, `instant` none. A request of several queries (searches that arrive together share one)
is answered after its slowest. Both schedules see the same scripts and latencies, and must write
the same trajectories (checked). On this CPU a 70-token result costs a row about a second of
prefill, so the default shape keeps results short (one sentence; `--sentences 4` is the
recipe's heavier shape).

Per engine and latency: each round runs a rollout of each schedule (which first alternates),
after one warm-up rollout each; printed: every rollout's wall time and its split (time/engine,
time/tools), the medians, and trajectory / turn (below 1: the trajectory schedule is faster);
with a slow search, also what hiding lock step's wait for its tools alone would give (where a
step's cost follows its tokens, as SmolLM2's on a CPU, that is near the best any schedule can
do: both compute the same tokens).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "RESULT "
SEED = 7
FILLER = "Let me think about which page could hold the answer before I search for it. " * 20
SENTENCE = "The page lists the figures, the dates and the places that the question asks about. "
SHAPES = {  # --shape: a turn's filler (log-normal median, sigma, cap) and its token limit
    "short": {"median": 6, "sigma": 1.2, "max_filler": 44, "max_new_tokens": 64},
    "long": {"median": 24, "sigma": 1.2, "max_filler": 240, "max_new_tokens": 256},
}
SHAPE = {**SHAPES["short"], "sentences": 1}  # the child's: --shape, --sentences


# ------------------------------------------------------------------ the script and the service
def searches(row: int) -> int:
    return random.Random(f"{SEED}-searches-{row}").choice([1, 2, 2, 3])


def filler_tokens(key: str) -> int:
    """Seeded, long-tailed: 2 to the shape's cap, log-normal (short: median 6, long: 24; sigma 1.2)."""
    draw = random.Random(f"{SEED}-len-{key}").gauss(math.log(SHAPE["median"]), SHAPE["sigma"])
    return min(SHAPE["max_filler"], max(2, round(math.exp(draw))))


def latency(row: int, turn: int, profile: str) -> float:
    """Seconds the service takes for row `row`'s search in turn `turn`: `tail` log-uniform on
    0.05-2 s (median 0.32 s, one in ten above 1.4 s), `lognormal` median 0.2 s clipped to
    0.05-2 s (one in ten above 0.72 s), `instant` none."""
    draw = random.Random(f"{SEED}-lat-{row}-{turn}")
    if profile == "tail":
        return math.exp(draw.uniform(math.log(0.05), math.log(2.0)))
    if profile == "lognormal":
        return min(2.0, max(0.05, math.exp(draw.gauss(math.log(0.2), 1.0))))
    return 0.0


class Service:
    """POST /search: each query `g<G>t<T> row<R>` answered after latency(R, T); a request after its slowest."""

    def __init__(self, profile: str):
        self.profile, self.passage = profile, SENTENCE * SHAPE["sentences"]
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self._reply({"status": "ok"})

            def do_POST(self):
                items = json.loads(self.rfile.read(int(self.headers["content-length"])))
                keys = [tuple(map(int, re.findall(r"\d+", item["query"])[-2:][::-1])) for item in items]
                time.sleep(max((outer.latency(*k) for k in keys), default=0.0))
                self._reply([{"id": item["id"], "results": [
                    {"doc_id": f"d{k[0]}-{k[1]}", "score": 1.0, "text": f"row {k[0]} turn {k[1]}: {outer.passage}"}]}
                    for item, k in zip(items, keys)])  # fmt: skip

            def _reply(self, body):
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def latency(self, row: int, turn: int) -> float:
        return latency(row, turn, self.profile)


class RowTagged:
    """The search tool, each query tagged with its row (the service draws a latency per row and turn)."""

    name = "search"

    def __init__(self, tool, n: int):
        self.tool, self.n = tool, n

    async def __call__(self, argument, state):
        row = int(state.sample.uid.split("-")[1]) * self.n + state.index
        return await self.tool(f"{argument} row{row}", state)


# ------------------------------------------------------------------ forcing the scripts
@functools.cache
def script_ids(tokenizer, group: int, row: int, turn: int) -> tuple[int, ...]:
    """Turn `turn` of row `row` as token ids: the seeded number of filler tokens, then the action."""
    key = f"g{group}" if turn == 0 else f"r{row}t{turn}"
    action = f"<search>g{group}t{turn}</search>" if turn < searches(row) else "<answer>42</answer>"
    filler = tokenizer(FILLER, add_special_tokens=False)["input_ids"][: filler_tokens(key)]
    return tuple(filler + tokenizer(action, add_special_tokens=False)["input_ids"])  # cached: never changed


def force_hf(tokenizer, n: int) -> None:
    """The built-in engine draws each row's scripted token in place of the sampled one."""
    import torch

    import grouprl.rollout.engines.hf as hf
    from grouprl.rollout.engines.hf_session import RunningSession

    real_draw, real_decode, real_sample = RunningSession._draw, hf.HFEngine._decode, hf.sample_next
    state = {"turn": -1, "position": 0}

    def draw(session):
        drawn = real_draw(session)
        for i, turn in enumerate(session.running):
            script = script_ids(tokenizer, turn.row // n, turn.row, turn.index)
            drawn[i] = script[min(len(turn.tokens), len(script) - 1)]
        return drawn

    def decode(engine, *args, **kwargs):  # lock step: a decode call is a turn of every row in it
        state["turn"], state["position"] = state["turn"] + 1, 0
        return real_decode(engine, *args, **kwargs)

    def sample_next(logits, params, generator, banned=None):
        drawn = real_sample(logits, params, generator, banned)
        if state["turn"] >= 0:
            rows = generator._rows.tolist()
            scripts = [script_ids(tokenizer, r // n, r, state["turn"]) for r in rows]
            drawn = torch.tensor([s[min(state["position"], len(s) - 1)] for s in scripts], device=drawn.device)
        state["position"] += 1
        return drawn

    def open_session(engine, *args, **kwargs):
        state["turn"] = -1
        return real_open(engine, *args, **kwargs)

    real_open = hf.HFEngine.open_session
    RunningSession._draw = draw
    hf.HFEngine._decode, hf.sample_next, hf.HFEngine.open_session = decode, sample_next, open_session


def force_vllm(tokenizer, n: int) -> None:
    """vLLM draws each request's scripted token: a logits processor that reads the request's
    prompt (its question, its observations' row, its turns so far) and its output so far."""
    import torch
    import vllm
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

    class Forced(LogitsProcessor):
        def __init__(self, vllm_config, device, is_pin_memory):
            self.rows: dict[int, tuple[list[int], list[int]]] = {}

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update: BatchUpdate | None) -> None:
            if batch_update is None:
                return
            for index in batch_update.removed:
                self.rows.pop(index, None)
            for index, _params, prompt, output in batch_update.added:
                text = tokenizer.decode(list(prompt or []))
                group = int(re.search(r"question (\d+)", text).group(1))
                turn = len(re.findall(r"<search>g\d+t\d+</search>", text))
                row = int(re.findall(r"row (\d+) turn", text)[-1]) if turn else group * n
                self.rows[index] = (script_ids(tokenizer, group, row, turn), output)
            for a, b, direction in batch_update.moved:
                first, second = self.rows.pop(a, None), self.rows.pop(b, None)
                if first is not None:
                    self.rows[b] = first
                if direction == MoveDirectionality.SWAP and second is not None:
                    self.rows[a] = second

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            for index, (script, output) in self.rows.items():
                if index < logits.shape[0]:
                    token = script[min(len(output), len(script) - 1)]
                    kept = logits[index, token].clone()
                    logits[index].fill_(float("-inf"))
                    logits[index, token] = kept
            return logits

    init = vllm.LLM.__init__

    def with_forcing(self, *args, **kwargs):
        kwargs["logits_processors"] = [*(kwargs.get("logits_processors") or []), Forced]
        init(self, *args, **kwargs)

    vllm.LLM.__init__ = with_forcing


# ------------------------------------------------------------------ one engine, in a child
def flat_model(path: str, tokenizer) -> str:
    """SmolLM2's layout (30 layers, its vocabulary and tokenizer) at width 64, random weights
    (the turns are scripted, so what it would sample does not matter): a decode step costs about
    the same whatever its rows, as a 7B's does on a GPU until the batch is large. Saved once."""
    import tempfile

    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(tempfile.gettempdir()) / "grouprl-agent-schedule-flat"
    if not (folder / "config.json").exists():
        config = AutoConfig.from_pretrained(path)
        config.update(dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32))
        import torch

        torch.manual_seed(SEED)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return str(folder)


def step_costs(model, context: int = 300) -> dict[str, float]:
    """A decode step's milliseconds at 1 and 16 rows over `context` cached tokens (median of 10)."""
    import torch
    from transformers import DynamicCache

    costs = {}
    with torch.no_grad():
        for rows in (1, 16):
            cache, ids = DynamicCache(), torch.randint(100, 1000, (rows, context))
            model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            times = []
            for k in range(10):
                start = time.perf_counter()
                model(input_ids=ids[:, :1], position_ids=torch.full((rows, 1), context + k), past_key_values=cache, use_cache=True)
                times.append(time.perf_counter() - start)
            costs[str(rows)] = 1000 * statistics.median(times)
    return costs


def child(args) -> None:
    import torch

    from grouprl.config import AgentConfig, AgentRetrieverConfig, ModelConfig, RolloutConfig
    from grouprl.data.sample import Sample
    from grouprl.retriever.client import RetrievalClient
    from grouprl.rollout.agent import AgentLoop
    from grouprl.rollout.engines import SamplingParams, build_engine
    from grouprl.rollout.engines.streams import RowStreams
    from grouprl.rollout.tools.search import SearchTool
    from grouprl.trainer.models import load_causal_lm, load_tokenizer, resolve_model_path

    SHAPE.update(**SHAPES[args.shape], sentences=args.sentences)
    path = resolve_model_path(ModelConfig(path="builtin:smollm2-135m-instruct"))
    tokenizer = load_tokenizer(ModelConfig(path=path), path)
    if args.model == "flat":
        path = flat_model(path, tokenizer)
    model = load_causal_lm(ModelConfig(path=path), path, torch.device("cpu"), torch.float32).eval()
    (force_hf if args.child == "hf" else force_vllm)(tokenizer, args.n)
    rollout = RolloutConfig(engine=args.child, kv_cache_gb=1, max_model_len=2048)
    engine = build_engine(rollout, model, tokenizer, model_path=path, dtype=torch.float32)
    samples = [Sample(uid=f"q-{g}", messages=[{"role": "user", "content": f"This is question {g}: in which year "
               f"was the bridge on page {g} opened?"}]) for g in range(args.prompts)]  # fmt: skip
    params = SamplingParams(max_new_tokens=SHAPE["max_new_tokens"], temperature=0.8)
    out = {"step_ms": step_costs(model)} if args.child == "hf" else {}
    for profile in args.latencies:
        service = Service(profile)
        loops = {}
        for schedule in ("turn", "trajectory"):
            cfg = AgentConfig(enabled=True, schedule=schedule, max_turns=4, tools=["search"], answer_generator="none",
                              max_observation_tokens=256)  # fmt: skip
            search = SearchTool(RetrievalClient(service.url), top_k=1, max_in_flight=AgentRetrieverConfig().max_in_flight)
            tool = RowTagged(search, args.n)
            loops[schedule] = AgentLoop(engine, tokenizer, {"search": tool}, cfg)
        prompts = loops["turn"].encode_prompts(samples)
        runs: dict[str, list[dict]] = {"turn": [], "trajectory": []}
        seen: dict[str, list] = {}
        for r in range(-1, args.rounds):  # round -1: a warm-up of each
            order = ("turn", "trajectory") if r % 2 == 0 else ("trajectory", "turn")
            for schedule in order:
                streams = RowStreams(SEED, range(args.prompts * args.n))
                start = time.perf_counter()
                trajectories = loops[schedule].run(samples, prompts, args.n, params, streams)
                wall = time.perf_counter() - start
                seen.setdefault(schedule, [t.response_ids for t in trajectories])
                if r >= 0:
                    stats = loops[schedule].stats
                    runs[schedule].append({"wall": wall, "engine": stats["time/engine"], "tools": stats["time/tools"],
                                           "turns": stats["agent/turns_mean"]})  # fmt: skip
                    print(f"  {args.child} {profile:>7} round {r} {schedule:>10}: {wall:6.2f} s (engine "
                          f"{stats['time/engine']:.2f}, tools {stats['time/tools']:.2f})", file=sys.stderr, flush=True)  # fmt: skip
        same = sum(a == b for a, b in zip(seen["turn"], seen["trajectory"]))
        out[profile] = {"runs": runs, "same": same, "trajectories": len(seen["turn"])}
        service.server.shutdown()
    print(MARK + json.dumps({"engine": args.child, "threads": torch.get_num_threads(), **out}), flush=True)


def run_child(engine: str, args) -> dict:
    python = args.hf_python if engine == "hf" else args.vllm_python
    command = [python, str(Path(__file__).resolve()), "--child", engine, "--rounds", str(args.rounds),
               "--prompts", str(args.prompts), "--n", str(args.n), "--shape", args.shape, "--model", args.model,
               "--sentences", str(args.sentences), "--latencies", *args.latencies]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    lines = [x for x in done.stdout.splitlines() if x.startswith(MARK)]
    if done.returncode != 0 or not lines:
        sys.exit(f"{engine} child failed ({done.returncode})")
    return json.loads(lines[-1][len(MARK) :])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    p.add_argument("--latencies", nargs="+", default=["tail", "instant"], choices=["tail", "lognormal", "instant"])
    p.add_argument("--model", default="smollm2", choices=["smollm2", "flat"],
                   help="SmolLM2-135M, or its layout at width 64: a step's cost flat in its rows, as on a GPU")
    p.add_argument("--shape", default="short", choices=sorted(SHAPES), help="turns of at most 64 tokens (short) or 256 (long)")
    p.add_argument("--sentences", type=int, default=1, help="a search result's text: this many sentences (~16 tokens each)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--hf-python", default=str(ROOT / ".venv" / "bin" / "python"))
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--quick", action="store_true", help="1 round, 2 prompts x 2 samples")
    p.add_argument("--child", choices=["hf", "vllm"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.rounds, args.prompts, args.n = 1, 2, 2
    if args.child:
        child(args)
        return
    shape = SHAPES[args.shape]
    print(f"{args.prompts} prompts x {args.n} samples, at most 4 turns of {shape['max_new_tokens']} tokens (filler "
          f"2-{shape['max_filler']}, median {shape['median']}), "
          f"results of {args.sentences} sentence(s), float32, {args.rounds} rounds")  # fmt: skip
    for engine in args.engines:
        result = run_child(engine, args)
        if "step_ms" in result:
            cost = result["step_ms"]
            print(f"{engine:>5} {args.model}: a decode step over 300 tokens {cost['1']:.0f} ms at 1 row, {cost['16']:.0f} ms at 16")
        for profile in args.latencies:
            res = result[profile]
            med = {s: {k: statistics.median(x[k] for x in res["runs"][s]) for k in ("wall", "engine", "tools")}
                   for s in ("turn", "trajectory")}  # fmt: skip
            ratio = med["trajectory"]["wall"] / med["turn"]["wall"]
            print(f"{engine:>5} {profile:>7}: turn {med['turn']['wall']:6.2f} s (engine {med['turn']['engine']:.2f}, "
                  f"tools {med['turn']['tools']:.2f})  trajectory {med['trajectory']['wall']:6.2f} s (engine "
                  f"{med['trajectory']['engine']:.2f}, tools {med['trajectory']['tools']:.2f})  ratio {ratio:.2f}  "
                  f"same trajectories {res['same']}/{res['trajectories']}  ({result['threads']} threads)")  # fmt: skip
            if med["turn"]["tools"] > 0.5:  # lock step waited for its tools: what hiding that wait alone would give
                hidden = (med["turn"]["wall"] - med["turn"]["tools"]) / med["turn"]["wall"]
                print(f"{'':>13}  lock step waited {med['turn']['tools']:.2f} s for its tools: hiding that alone "
                      f"gives {hidden:.2f}; below it, the schedule also saved decode steps")  # fmt: skip


if __name__ == "__main__":
    main()
