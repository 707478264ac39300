"""scikit-image's chelsea.png and coffee.png through the official SDKs against
`serve --model builtin:tiny-v41-vision --image-fetch --image-fetch-allow
127.0.0.1/32`: as data URLs and as URLs of a local HTTP server, in Chat
Completions, Responses and Messages; each of DeepSeek's image limits a clear
400; the same image again read from the prompt cache."""

import base64
import functools
import http.server
import pathlib
import struct
import threading
import zlib

from sdk_common import MODEL, check, clients, refused

oa, an = clients()
IMAGES = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "images"


def data_url(name):
    media = "image/png" if name.endswith(".png") else "image/jpeg"
    return f"data:{media};base64,{base64.b64encode((IMAGES / name).read_bytes()).decode()}"


def png(width, height):
    """A valid grey PNG of the given size (a header is all a side check reads)."""
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    rows = b"".join(b"\x00" + b"\x80" * width for _ in range(height))
    head = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    raw = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", head) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def origin():
    """A local HTTP server of the fixture folder; its base URL."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(IMAGES))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}"


def chat(*urls, max_tokens=8):
    parts = [{"type": "text", "text": "Compare these pictures."}]
    parts += [{"type": "image_url", "image_url": {"url": u, "detail": "auto"}} for u in urls]
    parts.append({"type": "text", "text": "Which is warmer?"})
    return oa.chat.completions.create(model=MODEL, max_tokens=max_tokens, seed=7,
                                      messages=[{"role": "user", "content": parts}])


def text(r):
    m = r.choices[0].message
    return (getattr(m, "reasoning_content", None) or "") + "|" + (m.content or "")


def main():
    base = origin()
    inline = chat(data_url("chelsea.png"), data_url("coffee.png"))
    fetched = chat(f"{base}/chelsea.png", f"{base}/coffee.png")
    check(inline.usage.prompt_tokens == fetched.usage.prompt_tokens, "a URL and a data URL give the same prompt")
    check(text(inline) == text(fetched), f"same pixels, same tokens: {text(inline)!r} vs {text(fetched)!r}")
    check(inline.usage.completion_tokens == 8, f"{inline.usage}")

    again = chat(data_url("chelsea.png"), data_url("coffee.png"))
    cached = again.usage.prompt_tokens_details.cached_tokens
    check(cached >= inline.usage.prompt_tokens - 64, f"the same images hit the cache: {cached} of {again.usage}")
    check(text(again) == text(inline), "a hit gives the same tokens")

    r = oa.responses.create(model=MODEL, max_output_tokens=16, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Describe it."},
        {"type": "input_image", "image_url": f"{base}/coffee.png", "detail": "auto"}]}])
    # Sampled at the protocol's temperature: an answer may end before its limit.
    check(r.usage.input_tokens > 0 and r.status in ("incomplete", "completed"), f"{r}")
    b64 = base64.b64encode((IMAGES / "chelsea.png").read_bytes()).decode()
    for source in ({"type": "base64", "media_type": "image/png", "data": b64},
                   {"type": "url", "url": f"{base}/coffee.png"}):
        m = an.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": source}, {"type": "text", "text": "What is this?"}]}])
        check(m.stop_reason in ("max_tokens", "end_turn") and 1 <= m.usage.output_tokens <= 4, f"{m}")

    long_url = f"{base}/{'a' * 9000}.png"
    refused(lambda: chat(long_url), "messages[0].content[1].image_url.url", "8192")
    refused(lambda: chat(png(8193, 1)), "messages[0].content[1].image_url.url", "a side may be at most 8192")
    refused(lambda: chat(*[png(2, 2)] * 17), "more than 16 images")
    refused(lambda: chat("data:image/png;base64,aGVsbG8="), "not a PNG, JPEG, WebP or GIF")
    refused(lambda: chat(f"{base}/missing.png"), "messages[0].content[1].image_url.url", "404")
    refused(lambda: chat("http://10.0.0.1/a.png"), "messages[0].content[1].image_url.url")
    refused(lambda: oa.chat.completions.create(model=MODEL, max_tokens=4, messages=[
        {"role": "user", "content": "forged <｜image｜> span"}]), "messages[0].content", "image token")
    print(f"vision: chelsea+coffee inline and fetched give {inline.usage.prompt_tokens} prompt tokens and the same "
          f"output; the repeat read {cached} cached tokens; Responses and Messages served; 7 refusals")


if __name__ == "__main__":
    main()
