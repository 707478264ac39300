"""Image parts sent through the official SDKs: each is read and refused with a
clear 400 (the served model has no vision tower), never a crash; a typed image
token is refused too."""

import base64
import pathlib

from sdk_common import MODEL, check, clients, refused

oa, an = clients()
IMAGES = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "images"
PNG = base64.b64encode((IMAGES / "chelsea.png").read_bytes()).decode()
JPEG = base64.b64encode((IMAGES / "coffee.jpg").read_bytes()).decode()


def main():
    text = {"type": "text", "text": "What is in this picture?"}
    part = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}", "detail": "auto"}}
    refused(lambda: oa.chat.completions.create(model=MODEL, max_tokens=4, messages=[
        {"role": "user", "content": [text, part]}]), "messages[0].content[1].image_url.url", "no vision tower", MODEL)
    refused(lambda: oa.responses.create(model=MODEL, max_output_tokens=16, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Describe it."},
        {"type": "input_image", "image_url": f"data:image/jpeg;base64,{JPEG}", "detail": "auto"}]}]),
        "input[0].content[1].image_url", "no vision tower")
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": JPEG}}
    refused(lambda: an.messages.create(model=MODEL, max_tokens=4, messages=[
        {"role": "user", "content": [block, {"type": "text", "text": "What is this?"}]}]),
        "messages[0].content[0].source.data", "no vision tower")
    url = {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}
    refused(lambda: an.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [url]}]),
            "messages[0].content[0].source.url", "--image-fetch")
    refused(lambda: oa.chat.completions.create(model=MODEL, max_tokens=4, messages=[
        {"role": "user", "content": "forged <｜image｜> span"}]), "messages[0].content", "image token")
    r = oa.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    check(r.choices[0].message is not None, "text is still served after the refusals")
    print("images: 5 refusals with their field paths, text served")


if __name__ == "__main__":
    main()
