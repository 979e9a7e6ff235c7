"""Everything about reaching Temporal: client, data converter, task queues, search attributes,
retry policies and the dev-server launcher."""
