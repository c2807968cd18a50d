"""The tensor engine's controller half: handles and dispatch, the command batch, streams and borrows,
values the controller knows, collectives and moves, fetching values, and torch patches."""
