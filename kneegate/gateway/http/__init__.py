"""The client-facing HTTP: uvicorn's httptools protocol with the client limits (`wire`,
`limits`), the body writer the relay pushes chunks through (`body_writer`) and the request
cycle of HTTP/1.0 clients (`http10`). Imports nothing of the upstream side."""
