"""DEST: where export writes (a local directory, or a prefix in object storage), and nothing else."""
