"""The training state on disk: writing, finding, reading and repairing checkpoints.

- `checkpointer`: the `Checkpointer` (save, restore, rotation under `<model_dir>/checkpoints`)
  and the read-only `CheckpointReader`;
- `background`: checkpoints written by a thread from a copy in host memory (`async_checkpoint`);
- `discovery`: the checkpoints of a directory, found by listing, read back, their state file
  recovered, and the folders of writes cut short removed;
- `repairs`: the undo journal of the start-up repairs a refused run takes back.

The model_dir as a whole (its names, the writer lock, atomic JSON) is `engine.model_dir`'s.
Importing this package imports nothing: each module is imported where it is used.
"""
