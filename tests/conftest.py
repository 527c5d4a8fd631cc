"""Shared test set-up. Its presence puts this `tests` folder on sys.path (pytest's default
"prepend" import mode), so any test module can `from helpers import tiny_model_and_tokenizer`."""
