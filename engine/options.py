"""The choices and defaults the library itself accepts, in one TF-free module.

The library (`Trainer`, strategies, schedules, hooks) and the command line
(`engine.cli.settings`, which builds its flags from them) share these names, so
they live below both: the library never imports the command line, and
`--help` lists them without importing TensorFlow.
"""

SINGLE_HOST_STRATEGIES = ("default", "one_device", "mirrored")
MULTI_HOST_STRATEGIES = ("multi_worker_mirrored", "parameter_server", "tpu")
STRATEGY_NAMES = SINGLE_HOST_STRATEGIES + MULTI_HOST_STRATEGIES
# Precision name -> Keras dtype policy.
PRECISION_POLICIES = {"float32": "float32", "float16": "mixed_float16", "bfloat16": "mixed_bfloat16"}
SCHEDULE_NAMES = ("constant", "cosine", "step", "warmup_cosine")
NONFINITE_POLICIES = ("stop", "skip")
METRIC_MODES = ("auto", "min", "max")  # Whether a watched metric should go down or up.
COMMUNICATIONS = ("auto", "ring", "nccl")  # multi_worker_mirrored's collectives.
# Steps per compiled call: the Trainer's default and the CLI's (--steps_per_loop).
DEFAULT_STEPS_PER_LOOP = 50
DEFAULT_COLLECTIVE_TIMEOUT = 300.0
DEFAULT_STARTUP_TIMEOUT = 300.0
