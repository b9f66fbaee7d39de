from mla_convert.cli.commands import main

main()
