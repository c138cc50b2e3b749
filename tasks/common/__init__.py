"""What every data stage shares: schemas, Arrow I/O, the stage scaffold, Ray fan-out, progress."""
