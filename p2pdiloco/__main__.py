from p2pdiloco.cli.app import main

main()
