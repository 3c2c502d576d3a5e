from lightning_dltune.cli import main

main()
