import sys

from hpcrl.launch.entrypoint import main

sys.exit(main())
