"""Run directories: `logs` (read NeMo-RL-shaped logs: `read_run`), its readers `tensorboard`
(events files) and `train_data` (per-step jsonl), `writer` (`RunWriter`), `report`
(`jetrl compare`)."""
