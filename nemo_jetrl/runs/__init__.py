"""Run directories: `logs` (read and write NeMo-RL-shaped logs), `report` (`jetrl compare`)."""
