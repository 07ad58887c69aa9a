"""gpumem inside the trainers: ``gpumem.integrations.hf.GpumemCallback`` for Hugging Face's
``Trainer`` (each module imports its trainer only when imported itself)."""
