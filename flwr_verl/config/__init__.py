"""Typed configuration, validated once at the edge; it imports nothing else of flwr-verl.

Every knob lives in one dataclass: the engine's sections follow verl's names (``actor.clip_ratio``,
``rollout.n``, ``algorithm.adv_estimator``; ``config.engine``), the privacy sections
(``config.privacy``), the federation's follow Flower's kebab-case (``num-server-rounds``,
``proximal-mu``; ``config.federation``). ``parse_run_config`` turns Flower's flat run config
into these objects (``config.parse``); each ``__post_init__`` rejects a bad value with a
``ConfigError`` naming the key, the value and what is allowed, before any model is loaded.
What is derived from the config (SecAgg+'s parameters, a round's noise plan, verl's registry
names) is checked by its owner: ``flwr_verl.federation.load_run_config`` runs those checks too.
"""

from flwr_verl.config.engine import (  # noqa: F401
    ADV_ESTIMATORS,
    DP_ESTIMATORS,
    DP_POLICY_LOSSES,
    DPO_LOSS_NAMES,
    GROUP_ESTIMATORS,
    KL_TYPES,
    LABEL_SMOOTHED_DPO_LOSSES,
    LOSS_AGG_MODES,
    PER_SEQUENCE_AGG_MODES,
    PKG_PREFIX,
    REWARD_COMBINE,
    STAGES,
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    DataConfig,
    DPOConfig,
    EngineConfig,
    LocalBudget,
    ModelConfig,
    RewardConfig,
    RewardModelConfig,
    RewardModelPathConfig,
    RolloutConfig,
    TrainerConfig,
)
from flwr_verl.config.errors import (  # noqa: F401
    ConfigError,
    DataError,
    FlwrVerlError,
    require,
)
from flwr_verl.config.federation import (  # noqa: F401
    AGGREGATIONS,
    MAX_SERVER_LEARNING_RATES,
    ROBUST_AGGREGATIONS,
    CompressionConfig,
    FederationConfig,
    RunConfig,
    SecAggConfig,
)
from flwr_verl.config.parse import (  # noqa: F401
    engine_config,
    parse_run_config,
)
from flwr_verl.config.privacy import (  # noqa: F401
    GRAD_SAMPLE_MODES,
    NUM_EXAMPLES_WEIGHTS,
    PRIVACY_METRICS,
    ClientLevelConfig,
    DeidentifyConfig,
    PrivacyConfig,
)
