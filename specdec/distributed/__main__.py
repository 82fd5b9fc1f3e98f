"""`python -m specdec.distributed --model M --pipeline-parallel N`: a pipeline stage other than rank 0."""

import sys

from specdec.distributed.launch import main

sys.exit(main())
