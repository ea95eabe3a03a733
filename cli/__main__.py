from shmcoll.cli.main import main

main()
