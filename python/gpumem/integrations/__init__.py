"""gpumem inside the trainers: ``gpumem.integrations.hf.GpumemCallback`` for Hugging Face's
``Trainer``, ``gpumem.integrations.lightning.GpumemCallback`` for Lightning's (each module
imports its trainer only when imported itself)."""
