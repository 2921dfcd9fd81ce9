"""State in and out: checkpoints (checkpoint.py, with orbax_rows.py for padded rows), Hugging Face folders
(hf.py), and token data (corpus.py reads and splits it, data.py batches it)."""
