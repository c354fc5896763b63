"""What the tests share, in one place (pytest puts tests/ on the path: `pythonpath`).

    helpers.gateway          gateway configs, a fake engine, /metrics scraping, the identities
    helpers.rig              a fake engine and a gateway in front of it over real sockets
    helpers.process          `kneegate serve` as a process: a free port, until it answers
    helpers.faulty_upstream  an upstream that misbehaves on purpose (the fault suite)
    helpers.controllers      samples and engine stats for the pure controllers
    helpers.deploy           the PromQL shipped in deploy/ (dashboard and alert rules)
    helpers.k8s_schemas      Kubernetes' published schemas
    helpers.uvicorn_thread   an ASGI app on a real uvicorn server in a thread (sync tests)
"""
