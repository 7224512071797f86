from importlib.metadata import PackageNotFoundError
from importlib.metadata import version

try:
    __version__ = version("waterwave-hpo")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
