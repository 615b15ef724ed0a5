"""python demo.py [audio.wav ...] [--model PATH_OR_ID|tiny-random] [--device cpu|cuda] [--prompt TEXT]"""

import sys

from glmasr.cli import main

if __name__ == "__main__":
    sys.exit(main())
