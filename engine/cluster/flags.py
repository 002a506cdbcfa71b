"""The flags that say which cluster a process is in: shared by `engine.main`
(through `engine.flags`) and `engine.server`, resolved by `engine.cluster`."""

from absl import flags

from engine.cluster import DEFAULT_SLURM_PORT_BASE

flags.DEFINE_list("worker_hosts", None,
                  "Comma-separated host:port of every worker task (builds TF_CONFIG).")
flags.DEFINE_list("ps_hosts", None, "Comma-separated host:port of every parameter-server task.")
flags.DEFINE_string("chief_host", None,
                    "host:port of the chief (the parameter-server coordinator).")
flags.DEFINE_string("task_type", None, "This process's task with the host flags: worker, ps, chief, or evaluator "
                    "(evaluates each new checkpoint; needs no host flags).")
flags.DEFINE_integer("task_index", None, "This process's index within --task_type (default 0).")
flags.DEFINE_string("cluster_resolver", "tf_config",
                    "tf_config: the host flags or the TF_CONFIG variable; slurm: SLURM_* variables.")
flags.DEFINE_integer("slurm_port_base", DEFAULT_SLURM_PORT_BASE,
                     "With --cluster_resolver=slurm, a node's tasks listen on this port and up.")

FLAGS = flags.FLAGS


def cluster_from_flags(flag_values=FLAGS):
    """The `engine.cluster.Cluster` these flags (or TF_CONFIG / Slurm) describe."""
    from engine.cluster import resolve_cluster

    return resolve_cluster(
        worker_hosts=flag_values.worker_hosts, ps_hosts=flag_values.ps_hosts,
        chief_host=flag_values.chief_host, task_type=flag_values.task_type,
        task_index=flag_values.task_index, cluster_resolver=flag_values.cluster_resolver,
        slurm_port_base=flag_values.slurm_port_base,
    )
