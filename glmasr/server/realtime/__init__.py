"""The OpenAI Realtime transcription endpoint, ``GET /v1/realtime?intent=transcription`` (a WebSocket).

- ``protocol``: the wire: client events parsed and validated (``parse_client_event``), the session configuration in
  OpenAI's GA shape (``session.update``) and beta shape (``transcription_session.update``) with our extensions
  (``SessionConfig``), and every server event rendered as the ``openai`` package's types define it;
- ``routes``: the WebSocket route (auth, limits, one ``glmasr.live.session.LiveSession`` per connection) and the
  session limits (``RealtimeLimits``, the ``glmasr serve --realtime-*`` flags).
"""
