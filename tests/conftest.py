import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(__file__))  # so spawned ranks can import tests' helpers
warnings.filterwarnings("ignore", category=FutureWarning, module="torch")
