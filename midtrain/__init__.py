"""orthon.midtrain"""
