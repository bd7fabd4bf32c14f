"""Living beside an inner launcher that restarts workers itself: torchrun --max-restarts, NVRx ft_launcher
(docs/COEXISTENCE.md)."""
