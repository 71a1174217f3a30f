module kvgate

go 1.19
