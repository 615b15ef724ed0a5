"""Benchmark sections, kernel and frontend benchmarks, device checks and the helpers they share
(scripts/device.sh runs them; notes/device_script.md lists them)."""
