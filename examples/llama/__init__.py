"""A Llama-style model trained with FSDP2 on a Slurm job's hosts: from a notebook (notebooks/llama_fsdp.ipynb,
driven by `trainer.py`'s live functions) or as a script under `sbatch` (`train.py`, `train.sbatch`)."""
