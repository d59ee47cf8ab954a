"""The former path of `overlapkit.demos`, kept so that scripts importing `overlapkit.demo` still run."""

from .demos import *  # noqa: F401,F403
from .demos import __all__  # noqa: F401
