import hashlib
import json
import re

import bm25s
import pytest
from PIL import Image

from grouprl.data import load_samples
from grouprl.data.tasks import TASKS, make_task
from grouprl.data.tasks.slides import candidate_questions, make_corpus, make_questions, make_slides
from grouprl.errors import ConfigError
from grouprl.rollout.actions import parse_action
from grouprl.rollout.agent_prompts import PROTOCOL, PROTOCOL_SELF_ANSWER, with_protocol
from grouprl.rollout.gold import main, write_slides_task


def bm25_index(slides):
    """An index built here, independent of the task's code: bm25s with English stop words over
    title + bullets (what the retriever indexes)."""
    index = bm25s.BM25()
    index.index(
        bm25s.tokenize([f"{s.title}\n{s.text}" for s in slides], stopwords="en", show_progress=False),
        show_progress=False,
    )

    def top(query, k=3):
        ids, _ = index.retrieve(
            bm25s.tokenize([query], stopwords="en", show_progress=False), k=k, show_progress=False
        )
        return [slides[i].id for i in ids[0]]

    return top


def digest(folder):
    """sha1 of every file under `folder`, by relative path."""
    return {
        str(p.relative_to(folder)): hashlib.sha1(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    folder = tmp_path_factory.mktemp("slides")
    return folder, write_slides_task(folder, seed=3, n_train=60, n_val=20, image_size=(160, 90))


def corpus_of(files):
    return {r["id"]: r for r in map(json.loads, files.corpus.read_text().splitlines())}


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    a = write_slides_task(tmp_path / "a", seed=1, n_train=20, n_val=5, n_decks=4, image_size=(96, 54))
    write_slides_task(tmp_path / "b", seed=1, n_train=20, n_val=5, n_decks=4, image_size=(96, 54))
    c = write_slides_task(tmp_path / "c", seed=2, n_train=20, n_val=5, n_decks=4, image_size=(96, 54))
    da, db, dc = digest(tmp_path / "a"), digest(tmp_path / "b"), digest(tmp_path / "c")
    assert da == db
    assert {"corpus.jsonl", "train.parquet", "val.parquet", "sft_train.jsonl", "sft_val.jsonl"} <= set(da)
    for name in ("corpus.jsonl", "train.parquet", "sft_train.jsonl"):
        assert da[name] != dc[name], name
    assert a.corpus.read_text() != c.corpus.read_text()


def test_rewriting_a_folder_with_a_smaller_corpus_drops_stale_images(tmp_path):
    write_slides_task(tmp_path, seed=0, n_train=5, n_val=2, n_decks=5, image_size=(64, 36))
    write_slides_task(tmp_path, seed=0, n_train=5, n_val=2, n_decks=2, image_size=(64, 36))
    assert {p.stem for p in (tmp_path / "images").glob("*.png")} == {s.id for s in make_corpus(0, n_decks=2)}


def test_corpus_shape_and_images(task):
    folder, files = task
    corpus = corpus_of(files)
    slides = make_corpus(3)
    assert list(corpus) == [s.id for s in slides] and 84 <= len(slides) <= 132  # 12 decks of 7..11
    assert len({s.deck for s in slides}) == 12
    for slide in slides:
        record = corpus[slide.id]
        assert record["title"] == slide.title == f"{slide.deck}: {record['title'].split(': ')[1]}"
        assert 2 <= len(slide.bullets) <= 5
        assert record["text"] == "\n".join(f"- {bullet}" for bullet in slide.bullets)
        with Image.open(folder / record["image"]) as image:
            assert image.size == (160, 90) and image.format == "PNG"
            # drawn, not blank: title bar colour at the top, white under the bullets' right end
            assert image.getpixel((2, 2)) != (255, 255, 255) and image.getpixel((158, 60)) == (255, 255, 255)
    assert len(list((folder / "images").glob("*.png"))) == len(slides)


def test_splits_are_disjoint_and_sized(task):
    _, files = task
    train, val = load_samples([str(files.train)]), load_samples([str(files.val)])
    assert len(train) == 60 and len(val) == 20
    questions = lambda samples: {s.messages[-1]["content"] for s in samples}  # noqa: E731
    assert len(questions(train)) == 60 and len(questions(val)) == 20
    assert not questions(train) & questions(val)
    # held-out keys are held out whatever the sizes asked for
    slides = make_corpus(3)
    big_train = {q.key for q in make_questions(slides, 250, 3, "train")}
    big_val = {q.key for q in make_questions(slides, 60, 3, "val")}
    assert not big_train & big_val


def test_parquet_loads_with_gold_docs_that_hold_the_answer(task):
    _, files = task
    corpus = corpus_of(files)
    samples = load_samples([str(files.train), str(files.val)])
    kinds = {"single": 0, "compare": 0}
    for sample in samples:
        gold = sample.extra_info["gold_docs"]
        kinds[sample.extra_info["kind"]] += 1
        assert sample.uid == sample.extra_info["uid"] and sample.uid.startswith("slides-")
        # the question alone: the agent loop puts its protocol prompt in front
        assert [m["role"] for m in sample.messages] == ["user"] and isinstance(sample.ground_truth, str)
        assert len(gold) == (1 if sample.extra_info["kind"] == "single" else 2)
        assert all(doc in corpus for doc in gold)
        if len(gold) == 1:
            # the answer is the value of a bullet of the gold slide
            assert f": {sample.ground_truth}\n" in corpus[gold[0]]["text"] + "\n", sample.uid
        else:
            # a comparison names two projects; the answer is one of them, each gold slide is one's
            decks = [corpus[doc]["title"].split(": ")[0] for doc in gold]
            assert sample.ground_truth in decks and all(d in sample.messages[0]["content"] for d in decks)
    assert kinds == {"single": 64, "compare": 16}  # round(0.2 * 60) + round(0.2 * 20) comparisons


def test_comparison_answers_recomputed_from_the_corpus_text():
    slides = {s.id: s for s in make_corpus(5)}
    for q in [q for q in candidate_questions(list(slides.values())) if q.kind == "compare"][:200]:
        values = []
        for fact in q.facts:
            line = next(b for b in slides[fact.slide_id].bullets if b.startswith(fact.label + ": "))
            values.append((float(re.sub(r"[^0-9.]", "", line.split(": ")[1])), slides[fact.slide_id].deck))
        assert q.answer == max(values)[1]


def test_gold_queries_find_the_gold_slide_with_plain_bm25():
    top = bm25_index(make_corpus(7))
    samples = make_slides(80, 7, "train") + make_slides(20, 7, "val")
    for sample in samples:
        for query, gold in zip(sample.extra_info["gold_queries"], sample.extra_info["gold_docs"]):
            assert gold in top(query), (query, gold)


def test_gold_trajectories_follow_the_protocol(task):
    _, files = task
    top = bm25_index(make_corpus(3))
    records = [json.loads(line) for line in files.sft_train.read_text().splitlines()]
    samples = {s.uid: s for s in load_samples([str(files.train)])}
    assert len(records) == 60
    for record in records:
        messages = record["messages"]
        sample = samples[record["id"]]
        assert messages[:2] == with_protocol(sample.messages, PROTOCOL) and messages[0]["role"] == "system"
        assert (
            record["gold_docs"] == sample.extra_info["gold_docs"] and record["answer"] == sample.ground_truth
        )
        assert record["train_on"] == [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        searches = [messages[i]["content"] for i in record["train_on"][:-1]]
        assert len(searches) == len(record["gold_docs"])
        for i, (turn, gold) in enumerate(zip(searches, record["gold_docs"])):
            match = re.fullmatch(r"<think>[^<]+</think><search>([^<]+)</search>", turn)
            assert match, turn
            observation = messages[record["train_on"][i] + 1]
            assert observation["role"] == "user"
            # the search tool's text: the query, then "[rank] id | title" and the bullets per hit
            lines = observation["content"].split("\n")
            assert lines[0] == f'Results for "{match.group(1)}":' and len(lines) == 7
            shown = [re.fullmatch(r"\[\d\] (\S+) \| .+", line).group(1) for line in lines[1::2]]
            assert shown == top(match.group(1)) and gold in shown
        assert re.fullmatch(
            r"<think>[^<]+</think><search_complete>true</search_complete>", messages[-1]["content"]
        )
    assert len({r["messages"][2]["content"].split("</think>")[0] for r in records}) > 20  # varied thoughts


def test_self_answer_trajectories_end_with_the_gold_answer(tmp_path):
    """--self-answer changes only the gold trajectories: the self-answer protocol prompt and a
    last turn `<answer>` with the gold value in place of `<search_complete>`, also trained."""
    plain = write_slides_task(tmp_path / "plain", seed=3, n_train=8, n_val=2, n_decks=4, image_size=(64, 36))
    args = ["--seed", "3", "--train", "8", "--val", "2", "--decks", "4", "--self-answer"]
    assert main(["--out", str(tmp_path / "self"), *args]) == 0
    write_slides_task(
        tmp_path / "custom",
        seed=3,
        n_train=8,
        n_val=2,
        n_decks=4,
        image_size=(64, 36),
        system_prompt="Custom protocol.",
        self_answer=True,
    )
    a, b = digest(tmp_path / "plain"), digest(tmp_path / "custom")
    assert {name for name in a if a[name] != b[name]} == {"sft_train.jsonl", "sft_val.jsonl"}
    read = lambda path: [json.loads(line) for line in path.read_text().splitlines()]  # noqa: E731
    for split in ("sft_train", "sft_val"):
        samples = {s.uid: s for s in load_samples([str(tmp_path / "plain" / f"{split[4:]}.parquet")])}
        before = read(getattr(plain, split))
        after = read(tmp_path / "self" / f"{split}.jsonl")
        overridden = read(tmp_path / "custom" / f"{split}.jsonl")
        assert [r["id"] for r in after] == [r["id"] for r in before] == list(samples)
        kinds = set()
        for old, new, own in zip(before, after, overridden):
            sample, messages = samples[new["id"]], new["messages"]
            kinds.add(sample.extra_info["kind"])
            assert messages[:2] == with_protocol(sample.messages, PROTOCOL_SELF_ANSWER)
            assert own["messages"][0] == {"role": "system", "content": "Custom protocol."}
            assert own["messages"][1:] == messages[1:]
            # the same searches and observations; the last turn answers with the gold value
            assert messages[2:-1] == old["messages"][2:-1]
            thought = re.fullmatch(
                r"(<think>[^<]+</think>)<search_complete>true</search_complete>",
                old["messages"][-1]["content"],
            ).group(1)
            assert messages[-1] == {
                "role": "assistant",
                "content": f"{thought}<answer>{sample.ground_truth}</answer>",
            }
            action = parse_action(messages[-1]["content"])
            assert (action.kind, action.argument, action.valid) == ("answer", sample.ground_truth, True)
            assert new["answer"] == sample.ground_truth and new["gold_docs"] == old["gold_docs"]
            assert new["train_on"] == old["train_on"] and new["train_on"][-1] == len(messages) - 1
        if split == "sft_train":
            assert kinds == {"single", "compare"}


def test_page_images_put_the_first_hits_page_before_each_observation(tmp_path):
    """--page-images changes only the gold trajectories: each search observation starts with one
    <image> placeholder for the first hit's page (what the search tool shows a VLM), listed in
    order under `images` as paths inside the task folder; the text after it is unchanged."""
    plain = write_slides_task(tmp_path / "plain", seed=3, n_train=8, n_val=2, n_decks=4, image_size=(64, 36))
    write_slides_task(
        tmp_path / "pages", seed=3, n_train=8, n_val=2, n_decks=4, image_size=(64, 36), page_images=True
    )
    args = ["--seed", "3", "--train", "8", "--val", "2", "--decks", "4", "--page-images"]
    assert main(["--out", str(tmp_path / "command"), *args]) == 0
    pages, command = (folder / "sft_train.jsonl" for folder in (tmp_path / "pages", tmp_path / "command"))
    assert pages.read_text() == command.read_text()  # the command's flag, the same records
    a, b = digest(tmp_path / "plain"), digest(tmp_path / "pages")
    assert {name for name in a if a[name] != b[name]} == {"sft_train.jsonl", "sft_val.jsonl"}
    top = bm25_index(make_corpus(3, n_decks=4))
    read = lambda path: [json.loads(line) for line in path.read_text().splitlines()]  # noqa: E731
    for before, after in zip(read(plain.sft_train), read(tmp_path / "pages" / "sft_train.jsonl")):
        observations = [after["messages"][i + 1] for i in after["train_on"][:-1]]
        queries = [re.search(r"<search>([^<]+)</search>", after["messages"][i]["content"]).group(1)
                   for i in after["train_on"][:-1]]
        assert after["images"] == [f"images/{top(q)[0]}.png" for q in queries]
        assert all((tmp_path / "pages" / path).is_file() for path in after["images"])
        for old, new in zip([before["messages"][i + 1] for i in before["train_on"][:-1]], observations):
            assert new["content"] == "<image>" + old["content"]
        assert {k: v for k, v in after.items() if k != "messages" and k != "images"} == {
            k: v for k, v in before.items() if k != "messages"
        }
        assert "images" not in before


def test_registry_and_errors():
    assert TASKS["slides"] is make_slides
    samples = make_task("slides", 10, 0, "val", few_shot=False)
    assert [s.uid for s in samples] == [f"slides-val-{i:04d}" for i in range(10)]
    assert samples == make_slides(10, 0, "val") and samples != make_slides(10, 1, "val")
    with pytest.raises(ConfigError, match="only .* single val questions, asked for 800"):
        make_slides(1000, 0, "val")
    with pytest.raises(ConfigError, match="split must be one of"):
        make_slides(3, 0, "test")
    with pytest.raises(ConfigError, match="slides_per_deck"):
        make_corpus(0, slides_per_deck=(1, 3))


def test_module_command_writes_the_task(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--train", "6", "--val", "2", "--decks", "3"]) == 0
    assert "corpus: " in capsys.readouterr().out
    assert len(load_samples([str(tmp_path / "train.parquet")])) == 6
