module ferry.test/go-ticker

go 1.19
