"""HTTP plumbing shared by the two HTTP apps, server/ (the model server) and router/: server-sent events
(sse.py), API keys with the admin check (auth.py) and the dashboard page both serve (static/). No request
rules here: those are serving/'s."""
