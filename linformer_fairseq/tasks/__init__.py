from . import long_sentence_prediction  # noqa: F401  (registers the task)
