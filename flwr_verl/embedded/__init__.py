"""The embedded default: a tiny arithmetic task and model that the project makes itself, offline.

No hub download exists on the machines we target, so the default job needs nothing from one:
``embedded.task`` makes ``a+b=`` problems in verl's row format, split by a hash of each problem
into train / tune / val; ``embedded.model`` is the small Llama warm-started on train problems,
shipped with the package (``embedded/shipped/``, with a manifest of its recipe and sha256s) and
rebuilt by ``python -m flwr_verl.embedded``. Nothing here imports the rest of flwr-verl but
its errors: the data loaders depend on this room, never the other way.
"""

from flwr_verl.embedded.model import (  # noqa: F401
    MANIFEST,
    PORTABLE_KERNELS,
    RECIPE,
    SHIPPED,
    EmbeddedModelError,
    build_embedded_model,
    build_tokenizer,
    cache_root,
    embedded_model_path,
    file_sha256,
    main,
    read_manifest,
    rebuild_shipped,
    verify_model_dir,
    warm_start,
    warm_start_batches,
    write_manifest,
)
from flwr_verl.embedded.task import (  # noqa: F401
    DATA_SOURCE,
    MAX_OPERAND,
    SPLIT_FRACTIONS,
    SPLITS,
    arithmetic_rows,
    check_split,
    compute_score,
    problem_key,
    sample_problems,
    split_of,
    split_problems,
)
