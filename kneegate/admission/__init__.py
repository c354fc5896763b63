"""The pure admission core: admit now, queue, or shed. No I/O, no clocks, no asyncio.

Time comes in as data (`now` on every call), so the gateway (real time, through
`kneegate.gateway.gate`) and the simulator (`kneegate.sim`, virtual time)
run this very code. It imports `kneegate.controllers` and nothing else of kneegate's.

    queue       AdmissionQueue: offer, release, tick, pump, expire; owns each upstream
                controller's lifecycle. Its top layer, the decisions on one ticket, over
    classes     ClassQueues: a queue per priority class: pump, expire, withdraw, close,
                over
    slots       Slots: the upstreams: where a ticket runs, what is in flight and when a
                slot frees, what each controller hears
    types       its values: tickets, class and tenant policies, upstream state, verdicts
    wait        the predicted wait (completion rate, engine TTFT) and the standing-queue test
    fairness    fair shares between tenants, counted in tokens: who goes next, whom to shed
    ledger      each tenant's counter of the service it had: charges, refunds, where it
                starts, the one pooled account of the tenants any client can mint
    quota       tenants' tokens-a-minute buckets
    demand      the scale-out signal: the load offered over what the engines serve
    slow_start  an upstream's limit before its engine has shown saturation
    pools       admission for engines serving different models: a queue per pool
    affinity    prefix affinity: a prompt back to the engine that served its beginning
"""
