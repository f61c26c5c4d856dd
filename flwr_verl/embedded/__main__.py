"""``python -m flwr_verl.embedded [OUT_DIR]``: rebuild the shipped embedded model (``model.main``)."""

import json
import sys
from pathlib import Path

from flwr_verl.embedded.model import _CHILD, _build_here, main

if sys.argv[1:2] == [_CHILD]:  # build_embedded_model's child process: OUT RECIPE_JSON
    _build_here(Path(sys.argv[2]), json.loads(sys.argv[3]))
else:
    main()
