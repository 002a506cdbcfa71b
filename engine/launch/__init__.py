"""The launcher: `python -m engine.launch` (`__main__`), a whole cluster of training processes.

- `launcher`: the command's flags and program: a cluster on this machine, one process a task;
- `node_launcher`: one machine's part of a cluster of several (`--nnodes`, `--node_rank`);
- `rendezvous`: how the nodes' launchers learn every task's address and agree to restart or end
  (`protocol`, node 0's `server_side`, each node's `client_side`, the run's `secret`);
- `task_processes`: the tasks' processes both launchers start, watch, restart and stop;
- `task_server`: a worker or ps task of a parameter-server cluster (`python -m engine.server`).

A command package, beside `engine.cli`: only the commands (`engine.main`, `engine.server`,
`python -m engine.launch`) import it, never the library nor the command line's modules.
Its `__init__` imports nothing: `python -m engine.server` imports only what it needs.
"""
