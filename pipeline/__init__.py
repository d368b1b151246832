"""Everything around the GPU: settings, queue, store, API, CLI, batch files, control tasks."""
