import sys

from hpcrl.launch.driver import main

sys.exit(main())
