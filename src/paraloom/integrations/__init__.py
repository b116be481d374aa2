"""Optional bridges to other trainers (Lightning, Accelerate); each module is imported only when asked for."""


class MissingExtra(ImportError):
    """The package an integration bridges to is not installed; the message names the extra to install."""

    def __init__(self, needs: str, extra: str) -> None:
        super().__init__(f'{needs} is not installed: pip install "paraloom[{extra}]"')
