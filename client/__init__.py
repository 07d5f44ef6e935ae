"""dflash.client: DFlashClient (sync and asyncio) and the dflash-client CLI."""
