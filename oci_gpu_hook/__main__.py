import sys

from .hook import main

sys.exit(main())
