"""Process entry point for workers: light to import, so the controller can name it cheaply."""


def run(cfg: dict) -> None:
    from monarch.runtime.worker import WorkerConfig, main

    main(WorkerConfig(**cfg))
