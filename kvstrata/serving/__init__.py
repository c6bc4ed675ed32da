"""The transport-neutral serving core: what serving a request needs on the caller's side of the scheduler,
whatever carries it there (the HTTP process's ZMQ link, server/scheduler_client.py, or Engine's queue).

    errors.py     ApiError: a refused or failed request, classified by an HTTP status
    protocol.py   the native /generate body → a validated GenerateRequest (and the JSON field checks the
                  OpenAI parsers share)
    frontend.py   the request rules: tokenizing, validation against the model, n-expansion, the scheduler
                  message of one sequence, SGLang's result shape
    seq_state.py  SeqState: one output sequence (incremental detokenize, stop trimming, logprobs)
    registry.py   SequenceRegistry: the running sequences by rid (register / dispatch / release / abort)
    control.py    ControlCalls: control questions numbered, answers matched by id

It imports runtime/ (the messages) and model/ (the detokenizer), never server/, web/ or an HTTP library.
"""
