from exlcli.cli.app import main

main()
