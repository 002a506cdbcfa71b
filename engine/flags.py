"""Every command-line flag of `python -m engine.main`, and nothing else.

Names, models and datasets are plain strings checked by `RunConfig`, so
that every bad value gets the same kind of one-line message.
"""

from absl import flags

from engine.cluster import flags as cluster_flags  # noqa: F401  (--worker_hosts, --ps_hosts, --task_type, ...)
from engine.config import DEFAULT_STEPS_PER_LOOP

# Strategy and cluster.
flags.DEFINE_string("strategy", "default",
                    "default, one_device, mirrored, multi_worker_mirrored, parameter_server or tpu.")
flags.DEFINE_integer("cpu_devices", 1,
                     "Logical CPU devices to split the host CPU into; `mirrored` uses them "
                     "as replicas when there is no GPU.")
flags.DEFINE_integer("num_gpus", None, "GPUs for mirrored/one_device (default: all visible).")
flags.DEFINE_string("communication", "auto",
                    "multi_worker_mirrored collectives: auto, ring (gRPC) or nccl (GPUs).")
flags.DEFINE_float("collective_timeout", 300.0,
                   "Seconds a multi-worker collective waits for its peers before the run fails "
                   "(a dead worker becomes an error, not a hang); 0 waits forever.")
flags.DEFINE_float("startup_timeout", 300.0,
                   "Seconds a cluster task waits to reach its peers at start-up before it exits "
                   "with an error naming them; 0 waits forever.")
flags.DEFINE_string("tpu", None, "--strategy=tpu: `local` (TPU VM) or grpc://HOST:PORT.")

# What this process does (TF Model Garden's modes).
flags.DEFINE_string("mode", "train_and_eval",
                    "train (no evaluation), eval (the latest checkpoint once), train_and_eval, or "
                    "continuous_eval (each new checkpoint, until the final step's).")
flags.DEFINE_float("eval_timeout", 3600.0,
                   "continuous_eval: exit after this many seconds without a new checkpoint.")

# Model and data.
flags.DEFINE_string("model", "cnn", "Model name (models/registry.py), or package.module:function: "
                    "your function(input_shape, num_classes) returning a keras.Model of logits.")
flags.DEFINE_string("dataset", "digits",
                    "digits (offline default), mnist, synthetic or tfrecord.")
flags.DEFINE_string("data_dir", None, "Where mnist.npz or the TFRecord files are.")
flags.DEFINE_string("input_pipeline", "per_replica",
                  "per_replica: distribute_datasets_from_function (sharded, per-replica "
                  "batches); global: experimental_distribute_dataset over global batches.")

# How long and how.
flags.DEFINE_integer("global_batch_size", 64, "Examples per step over all replicas.")
flags.DEFINE_integer("train_steps", None, "Global steps to train to (alternative to --epochs).")
flags.DEFINE_float("epochs", None,
                   "Epochs to train (alternative to --train_steps; default 20 when neither is set).")
flags.DEFINE_integer("steps_per_loop", DEFAULT_STEPS_PER_LOOP, "Steps per compiled call.")
flags.DEFINE_integer("log_every", 0,
                     "Progress line every N steps (loops are cut to match; steps_per_loop "
                     "stays the longest); 0: one line per compiled loop.")
flags.DEFINE_integer("eval_every", 100, "Evaluate every N steps; 0 evaluates only at the end.")
flags.DEFINE_string("optimizer", "adam", "sgd, momentum, adam or adamw.")
flags.DEFINE_float("learning_rate", 1e-3, "Learning rate (the peak rate of a schedule).")
flags.DEFINE_string("lr_schedule", "constant",
                    "constant, cosine (to 0 at the last step), step (x0.1 after each third) or "
                    "warmup_cosine (linear warmup, then cosine).")
flags.DEFINE_integer("warmup_steps", 0, "Warmup steps of warmup_cosine (0: a tenth of the run).")
flags.DEFINE_float("clip_norm", None, "Clip the global gradient norm to this value.")
flags.DEFINE_integer("grad_accum_steps", 1,
                     "Split each replica's batch into this many micro-batches and "
                     "accumulate their gradients.")

flags.DEFINE_string("on_nonfinite", "stop",
                  "On a NaN/Inf loss: stop with an error (nothing saved), or skip the "
                  "update and count it in summaries.")

# State on disk.
flags.DEFINE_string("model_dir", None,
                    "Checkpoints, TensorBoard logs and metrics.json; restored from when "
                    "it holds a checkpoint (default: a new temporary directory).")
flags.DEFINE_integer("checkpoint_every", 500, "Save every N steps (and always at the end).")
flags.DEFINE_integer("max_checkpoints", 3, "Checkpoints to keep.")
flags.DEFINE_boolean("restore_fallback", False,
                     "If the latest checkpoint cannot be read, restore the newest older one "
                     "that can (the unreadable one is moved to checkpoints/unreadable/).")
flags.DEFINE_boolean("reset_optimizer", False,
                     "Resume the weights and step of the checkpoints with fresh optimizer state, "
                     "so that --optimizer, --lr_schedule or --mixed_precision may change.")
flags.DEFINE_string("export_dir", None,
                    "After training, write the model here as a SavedModel with a "
                    "serving_default signature.")

# Decisions from eval metrics (loss or accuracy), made after each evaluation.
flags.DEFINE_string("early_stop_metric", None, "Stop when this eval metric stops improving.")
flags.DEFINE_integer("early_stop_patience", 3, "Evaluations without improvement before stopping.")
flags.DEFINE_string("early_stop_mode", "auto", "min, max or auto (max for accuracy, min otherwise).")
flags.DEFINE_string("best_checkpoint_metric", None,
                    "Also keep the checkpoint with the best value of this eval metric in <model_dir>/best.")
flags.DEFINE_string("reduce_lr_metric", None,
                    "Multiply the learning rate by --reduce_lr_factor when this eval metric plateaus.")
flags.DEFINE_integer("reduce_lr_patience", 2, "Evaluations without improvement before reducing.")
flags.DEFINE_float("reduce_lr_factor", 0.5, "Factor for reduce-on-plateau, between 0 and 1.")
flags.DEFINE_float("min_learning_rate", 0.0, "Reduce-on-plateau never goes below this rate.")

# TensorBoard.
flags.DEFINE_string("profile_steps", None,
                    "START,END: profile the steps from global step START to END "
                    "(TensorBoard's Profile tab).")
flags.DEFINE_integer("histogram_every", 0,
                     "Histograms of every weight in TensorBoard's train run every N steps; 0: none.")

# Numerics and speed.
flags.DEFINE_integer("seed", 42, "Seed for weights, shuffling and dropout.")
flags.DEFINE_boolean("deterministic", False,
                     "Deterministic ops: bitwise-reproducible runs, somewhat slower.")
flags.DEFINE_string("mixed_precision", "float32", "float32, float16 (loss scaling) or bfloat16.")
flags.DEFINE_boolean("jit_compile", False, "Compile the per-replica step with XLA.")
flags.DEFINE_boolean("check_numerics", False,
                     "tf.debugging.enable_check_numerics: fail at the first op that makes a "
                     "NaN or Inf, naming it (slow; for debugging).")

FLAGS = flags.FLAGS
