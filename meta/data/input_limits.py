"""The size caps an input passes before it is read or decoded: one source for their defaults.

The ``CHC.INPUT.MAX_*`` keys and the functions that apply the caps default to these values, each far above an
ordinary photo or caption of a web corpus such as CC3M, so only a file built to eat memory or time meets a cap.  No
imports: the config schema and the decoders read it without importing each other.
"""

MAX_IMAGE_BYTES = 50 * 2**20  # bytes of an image file or tar member; a larger one is not read (checked with stat)
MAX_IMAGE_PIXELS = 50_000_000  # width * height declared in the header, checked before decoding
MAX_IMAGE_ASPECT = 20.0  # longer side / shorter side, checked before CHC's shorter-side resize
# longest manifest CSV/TSV field (characters), and the byte cap of a shard's caption / metadata member
MAX_FIELD_CHARS = 10_000_000


def image_caps(inp) -> dict:
    """``{"max_bytes", "max_pixels", "max_aspect"}`` from a ``CHC.INPUT`` node or the dict a hierarchy's
    ``meta["settings"]["CHC"]["INPUT"]`` records (a key it lacks, from before the key existed: the default),
    as keyword arguments of :func:`meta.chc.image_features.encode_rank` and the image loaders."""
    inp = inp if isinstance(inp, dict) else {}
    return {
        "max_bytes": int(inp.get("MAX_IMAGE_BYTES", MAX_IMAGE_BYTES)),
        "max_pixels": int(inp.get("MAX_IMAGE_PIXELS", MAX_IMAGE_PIXELS)),
        "max_aspect": float(inp.get("MAX_IMAGE_ASPECT", MAX_IMAGE_ASPECT)),
    }


def caps_away_from_defaults(caps: dict) -> list:
    """``["max_aspect=50.0", ...]``: the caps of :func:`image_caps` set away from their defaults, for a cached
    stage's fingerprint (empty at the defaults, so a cache from before the caps were keys stays valid)."""
    default = image_caps({})
    return [f"{name}={value!r}" for name, value in caps.items() if value != default[name]]
