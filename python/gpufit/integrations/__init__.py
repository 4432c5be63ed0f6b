"""Framework callbacks that confirm what a job runs and measure it.

- :mod:`gpufit.integrations.hf`: ``GpufitCallback`` for the Hugging Face Trainer;
- :mod:`gpufit.integrations.lightning`: ``GpufitCallback`` for Lightning's Trainer.

Each imports its framework only when imported itself.
"""
