import sys

from oci_gpu_hook.hook import main

sys.exit(main())
