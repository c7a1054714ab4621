"""Buffer + coordinator: the only place that knows about policy versions."""
