from . import models  # noqa: F401  (registers the models)
