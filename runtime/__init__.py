"""Everything about meshes, both sides: shapes, spawning, transport, controller, workers."""
